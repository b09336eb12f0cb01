"""`/metrics` with vLLM's names, labels and buckets, written with prometheus_client.

One CollectorRegistry per emulator instance, so several emulators can live in one process (tests).
Durations are in emulated seconds. prometheus_client adds the `_total` suffix of counters itself.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _token_buckets(max_model_len: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(float(value))
        exponent += 1


class TokenHistogram(Collector):
    """A histogram observed once per generated token: a bisect and two additions instead of prometheus_client's
    locked per-bucket walk (a fifth of the hot path's CPU). Exported as a normal Prometheus histogram."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: dict[str, str]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.labels = labels

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family


class EmulatorMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str]) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # vLLM exports no `_created` series either
        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(**values)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(**values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.success = {r: success.labels(**values, finished_reason=r) for r in FINISHED_REASONS}
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = TokenHistogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS, values
        )
        registry.register(self.itl)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*cache_info, "engine"],
            registry=registry,
        )
        info.labels(**cache_info, engine="0").set(1)

    def bind_gauges(
        self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]
    ) -> None:
        """Gauges read the engine's state when scraped, so the hot path never touches them."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def finished(self, reason: str, e2e: float, queue: float, tpot: float | None, prompt: int, output: int) -> None:
        self.success[reason].inc()
        self.e2e.observe(e2e)
        self.queue.observe(queue)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.request_prompt.observe(prompt)
        self.request_generation.observe(output)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
