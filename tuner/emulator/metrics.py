"""`/metrics` with vLLM 0.32's families, types, labels and buckets (vllm/v1/metrics/loggers.py, buckets.py), written
with prometheus_client as vLLM writes them, `_created` series included.

One CollectorRegistry per emulator instance, so several emulators can live in one process (tests).
Durations are in emulated seconds. prometheus_client adds the `_total` suffix of counters itself.
Families for what the emulator has no part of (multimodal and external KV caches, admission limits, the MFU
estimates vLLM leaves off by default) are exported at 0, as vLLM exports them when unused; the conformance fixtures
(tests/emulator/fixtures) hold the real list.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import enable_created_metrics
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

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
# vllm/v1/metrics/buckets.py
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, each pre-labelled
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
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
        self.created = time.time()

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
        family.samples.append(Sample(f"{self.name}_created", self.labels, self.created))
        yield family


class _Families:
    """Makes the families of one registry with vLLM's per-engine labels (model_name, engine "0")."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.labels = ["model_name", "engine"]
        self.values = {"model_name": model_name, "engine": "0"}

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self.labels, registry=self.registry).labels(**self.values)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self.labels, registry=self.registry).labels(**self.values)

    def by(self, name: str, doc: str, label: str, keys: tuple[str, ...]) -> dict[str, Counter]:
        family = Counter(name, doc, [*self.labels, label], registry=self.registry)
        return {k: family.labels(**self.values, **{label: k}) for k in keys}

    def gauges_by(self, name: str, doc: str, label: str, keys: tuple[str, ...]) -> dict[str, Gauge]:
        family = Gauge(name, doc, [*self.labels, label], registry=self.registry)
        return {k: family.labels(**self.values, **{label: k}) for k in keys}

    def hist(self, name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
        return Histogram(name, doc, self.labels, buckets=buckets, registry=self.registry).labels(**self.values)


class EmulatorMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str]) -> None:
        enable_created_metrics()  # type: ignore[no-untyped-call]  # vLLM exports `_created` series
        self.registry = CollectorRegistry(auto_describe=True)
        f = _Families(self.registry, model_name)
        self._engine_families(f, model_name)
        self._request_families(f, max_model_len)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*cache_info, "engine"],
            registry=f.registry,
        )
        info.labels(**cache_info, engine="0").set(1)

    def _engine_families(self, f: _Families, model_name: str) -> None:
        """The scheduler's state, the caches and the token and request counters."""
        self.running = f.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = f.gauges_by(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", "reason", WAITING_REASONS
        )
        sleep = f.gauges_by("vllm:engine_sleep_state", "Engine sleep state.", "sleep_state", SLEEP_STATES)
        sleep["awake"].set(1)  # the emulator never sleeps
        self.kv_usage = f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        for name in ("estimated_flops_per_gpu", "estimated_read_bytes_per_gpu", "estimated_write_bytes_per_gpu"):
            f.counter(f"vllm:{name}", "Estimated per-GPU work (off unless --enable-mfu-metrics).")
        self.prefix_queries = f.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.")
        self.prefix_hits = f.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        for name in (
            "external_prefix_cache_queries",
            "external_prefix_cache_hits",
            "mm_cache_queries",
            "mm_cache_hits",
        ):
            f.counter(f"vllm:{name}", "External KV connector and multimodal caches (not emulated).")
        self.preemptions = f.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = f.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = f.by(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source", PROMPT_SOURCES
        )
        self.prompt_cached = f.counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.cached_by_source = f.by(
            "vllm:prompt_tokens_cached_by_source", "Number of cached prompt tokens by source.", "source", CACHED_SOURCES
        )
        self.generation_tokens = f.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*f.labels, "finished_reason"],
            registry=f.registry,
        )
        self.success = {r: success.labels(**f.values, finished_reason=r) for r in FINISHED_REASONS}
        # Front-end admission limits (--max-num-queued-*) the emulator does not have: always 0. No engine label.
        admission = Counter(
            "vllm:admission_rejections",
            "Requests rejected at admission.",
            ["model_name", "reason"],
            registry=f.registry,
        )
        for reason in ADMISSION_REASONS:
            admission.labels(model_name=model_name, reason=reason)

    # one piece: vLLM's per-request histograms in one list, as /metrics lists them (names, help, buckets)
    def _request_families(self, f: _Families, max_model_len: int) -> None:
        """The per-request and per-step histograms."""
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt = f.hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation = f.hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = TokenHistogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            tuple(float(b) for b in ITERATION_TOKENS_BUCKETS), f.values,
        )  # fmt: skip
        f.registry.register(self.iteration_tokens)
        self.max_generation = f.hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.params_n = f.hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = f.hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.ttft = f.hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = TokenHistogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS, f.values
        )
        f.registry.register(self.itl)
        self.tpot = f.hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = f.hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = f.hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = f.hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = f.hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = f.hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_preemptions = f.hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_computed = f.hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )

    def bind_gauges(
        self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]
    ) -> None:
        """Gauges read the engine's state when scraped, so the hot path never touches them."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        # Every waiting request waits for capacity (KV blocks, the token budget, max_num_seqs); "deferred" is for
        # requests held back by a KV connector or structured-output compilation, which the emulator has not.
        self.waiting_by_reason["capacity"].set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def finished(self, reason: str, e2e: float, queue: float, tpot: float | None, prompt: int, output: int) -> None:
        self.success[reason].inc()
        self.e2e.observe(e2e)
        self.queue.observe(queue)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.request_prompt.observe(prompt)
        self.request_generation.observe(output)
        self.max_generation.observe(output)

    def phases(self, prefill_s: float, decode_s: float, preemptions: int, computed_prompt: int, cached: int) -> None:
        """A finished request's time in each phase and its prefill's split between computed and cached tokens."""
        self.prefill.observe(prefill_s)
        self.decode.observe(decode_s)
        self.inference.observe(prefill_s + decode_s)
        self.request_preemptions.observe(preemptions)
        self.prefill_computed.observe(computed_prompt)
        self.prompt_by_source["local_compute"].inc(computed_prompt)
        if cached:
            self.prompt_by_source["local_cache_hit"].inc(cached)
            self.prompt_cached.inc(cached)
            self.cached_by_source["device"].inc(cached)

    def request_params(self, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def cache_config_labels(
    *, block_size: int, block_size_given: bool, cache_dtype: str, prefix_caching: bool, utilization: float,
    num_blocks: int, kv_tokens: int, max_concurrency: float, kv_cache_memory_bytes: int | None,
) -> dict[str, str]:  # fmt: skip
    """Every label of vLLM 0.32's cache_config_info (CacheConfig.metrics_info()): the emulator's own figures where it
    has them, vLLM's defaults for a plain attention model (no Mamba layers, no offloading) elsewhere."""
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": cache_dtype,
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(prefix_caching),
        "gpu_memory_utilization": str(utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(max_concurrency, 2)),
        "kv_cache_memory_bytes": str(kv_cache_memory_bytes),
        "kv_cache_size_tokens": str(kv_tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": str(block_size_given),
    }
